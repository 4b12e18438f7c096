//! Progress of a long operation on stderr, at most once a second: done of total,
//! rate and ETA.

use std::time::{Duration, Instant};

pub struct Progress {
    what: String,
    started: Instant,
    shown: Instant,
}

impl Progress {
    pub fn new(what: String) -> Progress {
        let now = Instant::now();
        Progress {
            what,
            started: now,
            shown: now,
        }
    }

    /// Shows `done` of `total` bytes, with `extra` after them, if a second passed.
    pub fn bytes(&mut self, done: u64, total: u64, extra: &str) {
        if self.shown.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.shown = Instant::now();
        let rate = done as f64 / self.started.elapsed().as_secs_f64();
        let eta = total.saturating_sub(done) as f64 / rate.max(1.0);
        eprintln!(
            "{}: {} of {}{extra} ({}/s, ETA {eta:.0} s)",
            self.what,
            crate::size::format(done),
            crate::size::format(total),
            crate::size::format(rate as u64)
        );
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}
