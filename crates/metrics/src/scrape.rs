//! Reads a `/metrics` page: a plain HTTP/1.0 GET (no keep-alive, so the body ends
//! where the connection does) and a parser for the Prometheus text format.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// One scrape takes at most this long to connect, and as long again per read.
const TIMEOUT: Duration = Duration::from_secs(2);

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// `HOST:PORT` of a metrics URL (`http://HOST:PORT/metrics`) or address.
pub fn address_of(url: &str) -> &str {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    rest.split('/').next().unwrap_or(rest)
}

/// The page at `url` (`http://HOST:PORT/metrics` or `HOST:PORT`); `Err` is one line.
pub fn fetch(url: &str) -> Result<String, String> {
    let address = address_of(url);
    let socket = address
        .to_socket_addrs()
        .map_err(|e| format!("{address}: {e}"))?
        .next()
        .ok_or_else(|| format!("{address}: no address"))?;
    let mut stream = TcpStream::connect_timeout(&socket, TIMEOUT)
        .map_err(|e| format!("{address}: unreachable ({e})"))?;
    stream.set_read_timeout(Some(TIMEOUT)).ok();
    stream.set_write_timeout(Some(TIMEOUT)).ok();
    let mut response = Vec::new();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n")
        .and_then(|_| stream.read_to_end(&mut response))
        .map_err(|e| format!("{address}: {e}"))?;
    let response = String::from_utf8(response).map_err(|_| format!("{address}: not text"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{address}: not an HTTP response"))?;
    let status = head.lines().next().unwrap_or_default();
    match status.split_whitespace().nth(1) {
        Some("200") => Ok(body.to_string()),
        _ => Err(format!("{address}: {status}")),
    }
}

/// The samples of a Prometheus text page; lines it cannot read are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(sample)
        .collect()
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inside) = rest.strip_prefix('{') {
        let (parsed, after) = label_set(inside)?;
        labels = parsed;
        rest = after;
    }
    // A timestamp may follow the value.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// `a="x",b="y"}` -> the labels and what follows the `}`.
fn label_set(mut text: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        text = text.trim_start_matches([',', ' ']);
        if let Some(after) = text.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, after) = text.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_string(), value);
        text = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_labels_and_values() {
        let page = "# TYPE x counter\n\
                    x 3\n\
                    y_bucket{volume=\"a \\\"b\\\",c\",le=\"+Inf\"} 7 1700000000\n\
                    z{le=\"0.5\"} +Inf\n\
                    broken{le=\"0.5\" 1\n";
        let samples = parse(page);
        assert_eq!(samples.len(), 3);
        assert_eq!((samples[0].name.as_str(), samples[0].value), ("x", 3.0));
        assert_eq!(samples[1].label("volume"), Some("a \"b\",c"));
        assert_eq!(samples[1].label("le"), Some("+Inf"));
        assert_eq!(samples[1].value, 7.0);
        assert_eq!(samples[2].value, f64::INFINITY);
    }

    #[test]
    fn address_of_a_url() {
        assert_eq!(address_of("http://127.0.0.1:9/metrics"), "127.0.0.1:9");
        assert_eq!(address_of("127.0.0.1:9"), "127.0.0.1:9");
    }
}
