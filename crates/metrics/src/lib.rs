//! Prometheus metrics for every Floe process.
//!
//! The instrumented crates record through the `metrics` facade (a no-op until a
//! recorder is installed, so tests and the simulator pay nothing); the binary
//! installs the recorder here.
//!
//! - [`exporter`]: installs the process-wide recorder and serves `/metrics` over HTTP.
//! - [`scrape`]: fetches and parses a `/metrics` page (`floe top`, the tests).

pub mod exporter;
pub mod scrape;
